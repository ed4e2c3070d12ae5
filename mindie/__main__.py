from mindie.cli import main

main()
