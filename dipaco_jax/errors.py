"""Errors meant for the person running the job, not for a debugger.

`dipaco_jax.main` prints a `UserError` as one line (`error: <message>`) and
exits with status 2, without a traceback (`--verbose` shows it). Raise it, or
a subclass, wherever the fix is on the user's side (a flag, a config field,
the data, the workdir), with a message that names what to change. Anything
else that escapes is a bug and keeps its traceback.
"""


class UserError(Exception):
  """A problem the user fixes; the message names the flag or field."""
