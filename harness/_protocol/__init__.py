"""What the pool and its ranks both speak: the events between them, the notice board
and the deadlock rule. It belongs to neither side.
"""
