"""The training loops: RLOO and PPO steps, the loop every stage shares, and the alarms."""
