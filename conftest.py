# Tests and conformance cases import this checkout's packages first, whatever is installed
# (worker processes inherit sys.path from the process that starts them).
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
