"""The daemon process, its socket server, the verbs it serves, and its operations side."""
