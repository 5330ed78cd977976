from wildtrain.cli import main

main()
