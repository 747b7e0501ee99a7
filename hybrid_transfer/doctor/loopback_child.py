"""Entry point of the doctor's loopback children: ``python -m hybrid_transfer.doctor.loopback_child ROLE``."""

import sys

from hybrid_transfer.doctor.loopback import child_main

if __name__ == "__main__":
    child_main(sys.argv[1])
