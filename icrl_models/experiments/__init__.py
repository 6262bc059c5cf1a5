"""The papers' experiments, one module per paper, each a console command.

| command | module | paper |
|---|---|---|
| ``icrl-compare`` | :mod:`~icrl_models.experiments.ngram_ad` | N-Gram AD vs AD, Expected Max Performance over a sweep |
| ``icrl-headless`` | :mod:`~icrl_models.experiments.headless_ad` | Headless-AD on unseen action spaces |
| ``icrl-markov`` | :mod:`~icrl_models.experiments.markov_heads` | GPT2-DTMA's Markov heads, MoA weights |
| ``icrl-looped`` | :mod:`~icrl_models.experiments.looped` | looped transformers, in-context function learning |
| ``icrl-induction`` | :mod:`~icrl_models.experiments.induction_heads` | induction-head phase change; AD head scores |

Each module holds only its paper's protocol: its config (one ``--flag`` per field), its training and
evaluation, its tables and figure; the two with the most reporting keep it in a module of its own beside them
(:mod:`~icrl_models.experiments.ngram_ad_report`, :mod:`~icrl_models.experiments.markov_report`). What they
share lives in :mod:`~icrl_models.experiments.harness`: presets, statistics over seeds, the cached training
dataset, and result files that start with the command line and the machine that produced them;
:mod:`~icrl_models.experiments.sweep` runs a list of training runs one at a time or as Ray Tune trials. A new
experiment is a new module here with a ``main(argv)`` decorated by :func:`icrl_models._cli.command_line`, plus
its line in ``pyproject.toml``'s ``[project.scripts]``.
"""
