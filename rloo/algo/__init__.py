"""The method's maths: advantage estimators, losses, schedules, and the bandit toy experiment."""
