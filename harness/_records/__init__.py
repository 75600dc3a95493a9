"""What a run records and a check found: the typed shapes a rank sends, a rollout's
record and samples, and who hears of a check as it ends.
"""
