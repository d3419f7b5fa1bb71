"""A stand-in for nvcc in tests of the build's process handling: `fake_nvcc.py MODE PIDFILE ARGS...`.

`--version` answers as nvcc does. Otherwise MODE "hang" sleeps (a hung compiler: no CPU time used),
"busy" computes for 0.8 s of CPU time and then writes the `-o` file, "quick" writes it at once. Every call
appends its pid to PIDFILE.
"""

import os
import sys
import time

mode, pidfile, args = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(pidfile, "a") as f:
    f.write(f"{os.getpid()}\n")
if "--version" in args:
    print("Cuda compilation tools, release 13.0, V13.0.88")
    sys.exit(0)
if mode == "hang":
    time.sleep(3600)
start = time.process_time()
while mode == "busy" and time.process_time() - start < 0.8:
    pass
with open(args[args.index("-o") + 1], "wb") as f:
    f.write(b"fake object\n")
