import sys

from zerotron.cli import main

sys.exit(main())
