from timeslots.intervals import covered, free_slots, merge

__all__ = ["covered", "free_slots", "merge"]
