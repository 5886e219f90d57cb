"""What a failed child process said that matters: its error lines.

An engine that dies prints its root cause far above the end of its output
(shutdown logs follow it), so a parent that shows only the tail, or only a
log path, hides it. The oracle runner and the demo both show these lines.
"""


def error_lines(output: str, max_chars: int = 4000) -> str:
    """Each distinct line that names an error, in order, the last
    ``max_chars`` of them."""
    lines = dict.fromkeys(
        line.strip() for line in output.splitlines() if "Error" in line
    )
    return "\n".join(lines)[-max_chars:]
