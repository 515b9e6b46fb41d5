import sys

from pfppo_mega.planning.cli import main

raise SystemExit(main(sys.argv[1:]))
