"""`python -m peer` runs the same CLI as the `peer` console script."""

from peer.cli.main import main

if __name__ == "__main__":
    main()
