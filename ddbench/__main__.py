from ddbench.cli import main

main()
