"""Tools the policy calls inside its completion (issue 73): the calculator, and plug-ins in the reward functions' form."""
