"""Today's record stage plan, written from its code: the reference the stage tests compare with."""

from speedrun.config.stages import Stage, StagePlan

#: Today's record (train_gpt.py @ f411b3d3): 8 → 16 → 24 sequences of 2,048 per step, max document
#: 896 → 2,048, windows (1,3) → (3,7) → (5,11) → extension (6,13), 20 long blocks at the last validation.
STAGES_2026_07 = StagePlan(
    stages=(
        Stage(131072, 896, (1, 3), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), duration=1 / 3),
        Stage(262144, 2048, (3, 7), 1.52, (1.0, 0.5), (1.0, 0.0), duration=1 / 3),
        Stage(393216, 2048, (5, 11), 1.73, duration=1 / 3),
        Stage(393216, 2048, (6, 13), 1.0),
    ),
    scheduled_steps=1270,
    extension_steps=15,
    cooldown_frac=0.60,
    lr_floor=0.15,
    val_long_window=20,
)
