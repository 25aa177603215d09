"""Child processes that a test interrupts as Ctrl-C interrupts a program started at a terminal."""
import signal


def sigint_as_at_a_terminal() -> None:
    """`preexec_fn` for such a child: SIGINT back to its default action. A script's background job (`cmd &` without
    job control, as in `nohup ... &`) starts with SIGINT ignored and its children inherit that, so the test's
    SIGINT would not reach a child of a test run started that way."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
