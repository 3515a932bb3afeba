"""Failures that name their cause: which rank failed, where, and why; and a clean stop on SIGTERM.

- :mod:`.guard`: wrap a communicating step so its failure names the failing rank and the call.
- :mod:`.failure_board`: failure records shared through the process group's store.
- :mod:`.stall_watch`: a thread posting the call this rank is stuck in, so a peer can name it.
- :mod:`.shutdown`: SIGTERM on any rank stops every rank at the same batch boundary.
- :mod:`.death`: one line naming how a rank's process ended (the signal that killed it), for its launcher.
"""
