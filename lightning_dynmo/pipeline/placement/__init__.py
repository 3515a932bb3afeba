"""Where units and ranks sit: the rank grid, stage -> rank maps, process groups, and re-packing.

- :mod:`.layout`: the data x pipeline rank grid, stage -> rank maps, unit ownership, moves between placements.
- :mod:`.groups`: the process groups a rank grid trains over, and the check that ranks agree on an argument.
- :mod:`.release`: re-packing onto fewer ranks: who stays, what moves, the new groups, the release event.
"""
