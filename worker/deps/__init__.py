"""Dependencies as data: hardware detection, the registry of valid stacks, lock files and checks."""
