"""Finding a head in a checkpoint, validating it against the trunk, and attaching it at load."""
