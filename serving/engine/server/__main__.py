import sys

from serving.engine.server.serve import main

sys.exit(main())
