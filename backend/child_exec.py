"""python -m backend.child_exec [--private] LAUNCHER_PID -- COMMAND...: a child's setup, then exec into COMMAND.

What a child must have before it runs, set here instead of in a subprocess preexec_fn: a preexec_fn runs Python
between fork and exec in the launcher's copy, which is unsafe where the launcher runs other threads (gRPC's, a
test's): the child can hang or abort before exec (a clean-clone CI run lost the OpenAI front's start to a -6
exit). This is a fresh, single-threaded process that becomes COMMAND by exec, with the same pid, so the
launcher's records of the child stay right.
- always: SIGTERM when the launcher dies, so no server or load process outlives it (process_tree.die_with_parent;
  a launcher already gone: exit 1 without running COMMAND);
- --private (tritonserver): files private (umask 077) and a /dev/shm of its own for the python backend's regions
  (process_tree.private_shm); where the system refuses one, the NO_PRIVATE_SHM line on stdout says why, and the
  launcher protects the regions once the server is ready (docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import sys

from backend.process_tree import die_with_parent, private_shm

NO_PRIVATE_SHM = "warning: no private /dev/shm for tritonserver"


def main(argv: list[str]) -> int:
    private = argv[:1] == ["--private"]
    argv = argv[1:] if private else argv
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write(__doc__.split("\n", 1)[0] + "\n")
        return 2
    launcher, command = int(argv[0]), argv[2:]
    die_with_parent(launcher)
    if private:
        os.umask(0o077)
        why_not = private_shm()
        if why_not:
            os.write(1, f"{NO_PRIVATE_SHM}: {why_not}; its regions are readable by other users until it is "
                        "ready (docs/RELIABILITY.md)\n".encode())
    os.execvp(command[0], command)  # returns never: this process becomes COMMAND, or it raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
