import sys

from polytrain.cli.main import main

sys.exit(main())
