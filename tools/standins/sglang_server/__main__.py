from tools.standins.sglang_server.server import main

main()
