"""The transports (issue 53): each one's modules, moved here from transfer/."""
