#!/usr/bin/env bash
# Runs the command given (the README's pytest command) and, if a process
# crashed (a signal: exit 128+N), prints what CI logs cut off: the crashing
# thread's Python stack from faulthandler, and a C backtrace of each core
# file with gdb where it is installed.  The exit status is the command's.
set -uo pipefail
log=$(mktemp)
ulimit -c unlimited 2>/dev/null || true
before=$(date +%s)
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ge 128 ]; then
    echo "=== crash report: exit $rc (signal $((rc - 128))) ==="
    # faulthandler names the thread that crashed "Current thread".
    grep -n -A 40 "^Current thread" "$log" || echo "(no faulthandler 'Current thread' section)"
    if command -v gdb >/dev/null; then
        # The command's interpreter: the cores are of it or of worker
        # processes it spawned.
        exe=$(readlink -f "$(command -v "$1")")
        find . -maxdepth 3 -name 'core*' -type f -newermt "@$before" 2>/dev/null | while read -r core; do
            echo "=== gdb backtrace of $core ==="
            # The core's current thread is the one that crashed: it first, whole.
            gdb -batch -q -ex "bt 40" -ex "thread apply all bt 6" "$exe" "$core" 2>/dev/null \
                | grep -v "^\[New LWP\|^$" | head -250
            rm -f "$core"
        done
    fi
fi
rm -f "$log"
exit "$rc"
