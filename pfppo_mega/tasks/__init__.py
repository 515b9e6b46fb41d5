from pfppo_mega.tasks.addition import AdditionTask, Problem

__all__ = ["AdditionTask", "Problem"]
