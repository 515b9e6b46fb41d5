from pfppo_mega.tasks.addition import AdditionProblem, AdditionTask

__all__ = ["AdditionTask", "AdditionProblem"]
