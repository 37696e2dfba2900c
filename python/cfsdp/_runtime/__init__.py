"""The runtime shared by both faces: units, hooks, collectives, reduction."""
