"""Drives `deltafin chat` inside a real pseudo-terminal (run by tests/chat.rs): line editing and
history, Ctrl-C during a long prompt, and trimming when the conversation outgrows the context.
Usage: chat_pty.py BIN MODEL SCENARIO; prints what it saw and exits non-zero on a failure."""
import os
import pty
import select
import sys
import time

BIN, MODEL, SCENARIO = sys.argv[1], sys.argv[2], sys.argv[3]
EXTRA = {"edit": [], "interrupt": [], "overflow": ["--context", "160"]}[SCENARIO]

pid, fd = pty.fork()
if pid == 0:
    os.execv(BIN, [BIN, "chat", "--model", MODEL, "--max-new", "4"] + EXTRA)

seen = b""


def read_for(seconds, until=None):
    """Reads the terminal for up to `seconds`, or until `until` appears in what was read since."""
    global seen
    start, got = time.time(), b""
    while time.time() - start < seconds:
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            got += chunk
            seen += chunk
            if until is not None and until in got:
                break
    return got


def send(data):
    os.write(fd, data)


def fail(why):
    sys.stderr.write(f"FAILED: {why}\n--- terminal ---\n{seen.decode(errors='replace')}\n")
    os.kill(pid, 9)
    sys.exit(1)


read_for(30, b"> ")
if SCENARIO == "edit":
    # Type "hllo", move left three times, insert "e": the line sent is "hello".
    send(b"hllo")
    send(b"\x1b[D\x1b[D\x1b[D")
    send(b"e\r")
    read_for(10, b"> ")
    if b"^[[D" in seen:
        fail("arrow keys printed as ^[[D")
    # Up recalls the edited line; Enter sends it again; /stats shows two turns' prompt.
    send(b"\x1b[A")
    recalled = read_for(2)
    if b"hello" not in recalled:
        fail(f"Up did not recall the edited line: {recalled!r}")
    send(b"\r")
    read_for(10, b"> ")
    send(b"/nonsense\r")
    out = read_for(5, b"> ")
    if b"unknown command /nonsense" not in out:
        fail("an unknown command went to the model")
    # Replies of --max-new 4 tokens are cut, and say so; /clear starts over.
    if b"cut at 4 tokens" not in seen:
        fail("a reply cut by --max-new did not say so")
    send(b"/clear\r")
    if b"(new conversation)" not in read_for(5, b"> "):
        fail("/clear did not start a new conversation")
elif SCENARIO == "interrupt":
    # A long pasted message: Ctrl-C while its prompt is processed stops it within a second.
    send((b"numbers and boats " * 560) + b"\r")
    read_for(0.4)
    t0 = time.time()
    send(b"\x03")
    out = read_for(5, b"(stopped)")
    took = time.time() - t0
    if b"(stopped)" not in out:
        fail("Ctrl-C did not stop the prompt")
    if took > 1.0:
        fail(f"Ctrl-C took {took:.2f} s")
    print(f"stopped {took:.3f} s after Ctrl-C")
    read_for(5, b"> ")
    send(b"/stats\r")
    if b"stopped with Ctrl-C" not in read_for(5, b"> "):
        fail("/stats after Ctrl-C did not report the stopped reply")
    send(b"hi\r")
    if b"> " not in read_for(20, b"> "):
        fail("the chat did not go on after the stop")
elif SCENARIO == "overflow":
    for i in range(6):
        send(f"message {i}: tell me about numbers and boats\r".encode())
        read_for(20, b"> ")
    if b"context full" not in seen:
        fail("no notice when the oldest turns were dropped")
    send(b"/stats\r")
    out = read_for(5, b"> ")
    if b"prompt" not in out:
        fail("a message failed after the context filled")
send(b"\x04")
read_for(5)
_, status = os.waitpid(pid, 0)
if os.WEXITSTATUS(status) != 0:
    fail(f"exit status {status}")
print("ok")
