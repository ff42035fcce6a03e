"""
Data constants for the V-JEPA 2-AC GUI pipeline, shared by the generator, the loader and the trainer.

A trajectory file holds `embeddings` [N, T, P, D] and `actions` [N, T-1, A, C]; see README.md, V-JEPA 2-AC GUI predictor.
Everything here is a plain constant so that any script can import it without side effects.
"""

# ---------------------------------------------------------------------------------------------------------------
# Real data: frozen V-JEPA 2 ViT-L tokens of GUI screen recordings

# latent steps per trajectory (T)
NUM_STEPS = 8
# patch grid side of one latent step
GRID = 16
# patch tokens per latent step (P = GRID * GRID)
PATCHES_PER_STEP = GRID * GRID
# encoder width (D), ViT-L
EMBED_DIM = 1024
# smallest D the predictor can learn from: its loss layer-norms tokens over D, which maps every token of
# width 1 to 0 (a loss of exactly 0 and no gradient)
MIN_EMBED_DIM = 2
# atomic GUI actions recorded between two latent steps (A)
ACTIONS_PER_STEP = 250
# channels of one atomic action: [x, y, touch], each in [0, 1] (C)
ACTION_CHANNELS = 3
# names of the action channels, in order
ACTION_CHANNEL_NAMES = ("x", "y", "touch")
# most channels an action may have ([x, y, touch] and a few of the recorder's own): more are refused, as they
# are what actions stored channels-first ([N, T-1, C, A], A=250) read as
MAX_ACTION_CHANNELS = 8
# range of every value of those channels: x and y as fractions of the screen width and height, touch 0..1;
# the loader refuses files outside it (pixel coordinates would train silently)
ACTION_VALUE_RANGE = (0.0, 1.0)
# autoregressive steps penalised by the rollout loss; needs NUM_STEPS - 1 >= ROLLOUT_HORIZON
ROLLOUT_HORIZON = 2
# latent steps per second seen by the observer (encoder)
OBSERVATION_HZ = 2
# atomic actions per second from the input recorder; ACTION_HZ / OBSERVATION_HZ == ACTIONS_PER_STEP
ACTION_HZ = 500

assert ACTION_HZ // OBSERVATION_HZ == ACTIONS_PER_STEP and ACTION_HZ % OBSERVATION_HZ == 0

# ---------------------------------------------------------------------------------------------------------------
# Small synthetic data: the default of create_synthetic_data.py, trains on a CPU in seconds

# latent steps (T); T - 1 >= ROLLOUT_HORIZON
SMALL_NUM_STEPS = 4
# patch tokens per step (a 4 x 4 grid)
SMALL_PATCHES_PER_STEP = 16
# token width (D)
SMALL_EMBED_DIM = 32
# atomic actions per step (A)
SMALL_ACTIONS_PER_STEP = 10
# channels per atomic action (C): [x, y, touch]
SMALL_ACTION_CHANNELS = ACTION_CHANNELS

assert SMALL_NUM_STEPS - 1 >= ROLLOUT_HORIZON

# ---------------------------------------------------------------------------------------------------------------
# Synthetic world

# seed of the synthetic "encoder" (state -> tokens); fixed so that train and val sets share one encoder
WORLD_SEED = 1234
# std of the Gaussian noise added to synthetic tokens
SYNTHETIC_NOISE = 0.05

# ---------------------------------------------------------------------------------------------------------------
# Predictor sizes; "vjepa2_ac" is Meta's V-JEPA 2-AC predictor (width 1024, depth 24, 16 heads)

PREDICTOR_PRESETS = {
    "tiny": dict(predictor_dim=32, depth=1, num_heads=2),
    "small": dict(predictor_dim=64, depth=2, num_heads=4),
    "vjepa2_ac": dict(predictor_dim=1024, depth=24, num_heads=16),
}
# preset used when none is named
DEFAULT_PREDICTOR_PRESET = "small"
