import sys

from .showcase import main

sys.exit(main())
