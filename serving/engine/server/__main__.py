import logging
import os
import sys

from serving.engine.server.serve import main

code = main()
# Everything of the worker is closed by now (server, engine, grammar and template processes). Leave
# without the interpreter's finalization, where triton's nanobind module reports every IR object and
# type it still holds as "leaked": a screenful on each stop of `make up` (issue 39, item 8).
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
