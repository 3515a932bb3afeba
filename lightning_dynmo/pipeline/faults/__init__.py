"""Failures that name their cause: which rank failed, where, and why; and a clean stop on SIGTERM.

- :mod:`.guard`: wrap a communicating step so its failure names the failing rank and the call.
- :mod:`.failure_board`: failure records shared through the process group's store.
- :mod:`.shutdown`: SIGTERM on any rank stops every rank at the same batch boundary.
"""
