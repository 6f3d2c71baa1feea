"""The demo application built on :mod:`attention`: the ``abft`` command and what it runs.

Nothing in :mod:`abftgemm` or in the rest of :mod:`attention` imports this package; it only uses
their public API.

:mod:`~attention.experiments.cli`          the ``abft`` command (``campaign``, ``train``, ``bench``,
                                           ``demo``); ``python -m attention`` runs it too
:mod:`~attention.experiments.flags`        one definition per run's configuration: dataclass
                                           fields that are also command-line flags
:mod:`~attention.experiments.campaign`     fault-injection campaign over sites, kinds, patterns
:mod:`~attention.experiments.fused_campaign`  the campaign's trials on the fused core's
                                           internal sites (``--core fused``)
:mod:`~attention.experiments.outcomes`     a trial's outcome and the campaign's "differs" bound
:mod:`~attention.experiments.model`        a small GPT on the protected layer, manual backward
:mod:`~attention.experiments.train`        training under faults: unprotected, protected,
                                           checkpoint/restore
:mod:`~attention.experiments.plots`        campaign and training figures (matplotlib, optional)
:mod:`~attention.experiments.check_costs`  counted cost of each site's checks (the checking-plan
                                           example, docs/checking_plan.md)
"""
