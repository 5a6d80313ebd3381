import sys

from duplexd.cli import main

sys.exit(main())
