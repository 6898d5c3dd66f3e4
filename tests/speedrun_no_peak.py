"""`python -m speedrun` with MFU's reference peak fixed instead of measured: the measurement is a bf16
matmul, minutes on CPUs without bf16 units (AVX2-only hosts), and the tests that launch this read
losses, not MFU. Usage: `torchrun ... -m tests.speedrun_no_peak train ...`."""

import sys

from speedrun.train import progress

progress.matmul_peak = lambda device: 1e12

if __name__ == "__main__":
    from speedrun.cli import main

    sys.exit(main(sys.argv[1:]))
