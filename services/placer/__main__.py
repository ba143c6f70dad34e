from hsched.threads import serve_blas_on_one_thread

serve_blas_on_one_thread()  # before anything imports numpy (hsched.threads)

from services.placer.server import main  # noqa: E402

main()
