"""The retrieval experiment's arguments (`RetrievalArguments`, one part of `arguments.ExperimentArguments`): passkey
documents in training, the probe at every length and depth, the evaluation arms, the seeds and the copy's learning
curve. Every field is a YAML key and an option of `hf-alibi train`."""

from dataclasses import dataclass, field


@dataclass
class RetrievalArguments:
    """The retrieval experiment (`retrieval`): a share of passkey documents in training, the passkey probe at every
    evaluation length and depth, and the training-free extensions evaluated beside each trained model."""

    _argument_group_name = "retrieval probe"

    retrieval: bool = field(
        default=False,
        metadata={
            "help": "Run the retrieval experiment (hf_alibi/experiments/retrieval/experiment.py): perplexity and passkey "
            "retrieval of every evaluation arm by length, instead of the plain length evaluation."
        },
    )
    passkey_share: float = field(
        default=0.25,
        metadata={
            "help": "Share of training blocks that are passkey documents (each fits train_length); 1 trains on passkey "
            "documents alone (a diagnosis: the copy without the language modelling around it)."
        },
    )
    passkey_digits: int = field(default=5, metadata={"help": "Digits of each passkey."})
    passkey_depths: list[float] = field(
        default_factory=lambda: [0.0, 0.5, 1.0],
        metadata={"help": "Where the needle sits in the filler: 0 first, 1 right before the question."},
    )
    passkey_samples: int = field(
        default=93,
        metadata={
            "help": "Probes per (arm, length, depth); 93 is the fewest for a 95 percent Wilson interval narrower than "
            "+-10 points at any accuracy (passkey.samples_for_half_width(0.10))."
        },
    )
    eval_arms: list[str] = field(
        default_factory=list,
        metadata={
            "help": "MODEL or MODEL+EXTENSION (slope_interp for ALiBi; linear, dynamic, yarn for rotary: "
            "eval_arms.py); default: every trained model as it is."
        },
    )
    kept_eps: float = field(
        default=1e-7, metadata={"help": "eps of the certified-skipping measurement of the ALiBi arms (kept_context)."}
    )
    seeds: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Run the whole experiment once per seed, each in <output_dir>/seed_<S>/, and pool them at the top "
            "level: retrieval over every seed's probes with the seeds' min-max (retrieval_seeds.py); default: one run "
            "with `seed`."
        },
    )
    copy_curve_steps: int = field(
        default=0,
        metadata={
            "help": "Every N training steps, the copy's learning curve at the training length (exact match, per-digit "
            "accuracy, loss on the copied and on the needle's digits) to <model>/copy_curve.json and the results' "
            "metadata (copy_curve.py); 0: none."
        },
    )

    def __post_init__(self):
        if not 0 <= self.passkey_share <= 1:
            raise ValueError(f"passkey_share must be in [0, 1], got {self.passkey_share}")
        if self.passkey_digits < 1 or self.passkey_samples < 1:
            raise ValueError(
                f"passkey_digits and passkey_samples must be positive, got {self.passkey_digits} and "
                f"{self.passkey_samples}"
            )
        if not self.passkey_depths or any(not 0 <= d <= 1 for d in self.passkey_depths):
            raise ValueError(f"passkey_depths must be in [0, 1], got {self.passkey_depths}")
        if not 0 < self.kept_eps < 1:
            raise ValueError(f"kept_eps must be in (0, 1), got {self.kept_eps}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        if self.copy_curve_steps < 0:
            raise ValueError(f"copy_curve_steps must be >= 0 (0: no curve), got {self.copy_curve_steps}")


__all__ = ["RetrievalArguments"]
