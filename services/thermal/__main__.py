from services.thermal.server import main

main()
