"""A compiled helper program driven line by line: the oracle and mirror tests' harness."""
import subprocess


class LineProcess:
    """A child process that answers one stdout line per stdin line; ``what`` names it in errors."""

    def __init__(self, argv, what="helper"):
        self.what = what
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def ask(self, requests):
        """Send ``requests`` (strings without newline) in one write; return their answers."""
        self.proc.stdin.write("".join(r + "\n" for r in requests))
        self.proc.stdin.flush()
        answers = []
        for r in requests:
            line = self.proc.stdout.readline()
            assert line, "%s died (exit %s) on %r" % (self.what, self.proc.poll(), r)
            line = line.strip()
            assert not line.startswith("ERR"), "%s rejected %r: %s" % (self.what, r, line)
            answers.append(line)
        return answers

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
