from services.placer.server import main

main()
