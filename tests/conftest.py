import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(TESTS), TESTS):  # the checkout, and tests/helpers.py
    if path not in sys.path:
        sys.path.insert(0, path)
