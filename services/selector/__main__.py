from services.selector.server import main

main()
