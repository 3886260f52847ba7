# The GPU tests share helpers with tests/ (symm_mem_helpers, lowering_rank); worker processes
# inherit sys.path from the process that starts them.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
