#pragma once
/// @file
/// Adaptation policies over a running data-parallel job (KungFu, Mai et al., OSDI 2020: monitors
/// feeding policies whose actions every worker applies at the same point; Pollux, Qiao et al.,
/// OSDI 2021: re-planning the batch for goodput).
///
/// `adaptive_job` wraps a `train::data_parallel_step` (held by reference) and calls its
/// policies at the job's events: before training, before and after each epoch, after each
/// step, after training, and after the framework moved the job to a world of another size. A
/// policy is any object with one or more of the members
///
///     void before_train(const job_view&, job_action&);
///     void before_epoch(const job_view&, job_action&);
///     void after_step(const job_view&, job_action&);
///     void after_epoch(const job_view&, job_action&);
///     void after_train(const job_view&, job_action&);
///     void on_world_change(const job_view&, job_action&);
///
/// detected at compile time. The `job_view` holds the monitors (the step's metrics and
/// settings, the ranks, the epoch, every rank's time-to-ready and time inside the previous
/// step, the throughput derived from them), identical on every rank; the `job_action` is what
/// the policies ask for. Policies run in the order they were passed and share one job_action
/// per event, so a later policy sees (and may overwrite) what an earlier one proposed.
///
/// After the policies of one event ran, the ranks vote: every field of the action (present or
/// not, its value; a vector by its size and a hash) is agreed with one small allreduce
/// (`gradapt::agree_values`). An action that differs between ranks is a gradapt::error on every
/// rank naming the field, and nothing is applied. An agreed action writes its settings fields
/// into `step.settings()` (they take effect at the next step on every rank) and adds its resize
/// request (`drop_ranks`, `world_size`) to `decision()`, which the framework reads: only the
/// framework can change the world, after which it restores the step and calls
/// `world_changed()`.
///
/// Built-in policies: `straggler_policy` (detect, rebalance or drop slow ranks),
/// `sync_switch_policy` (switch to LocalSGD's local steps while the throughput is low) and
/// `goodput_policy` (Pollux's batch re-planning with `search_goodput`).
/// docs/algorithms/elastic.md has the options, the costs and the tests.
///
/// This header includes both parts: elastic/job.hpp (the monitors, actions, vote and
/// `adaptive_job`) and elastic/builtin_policies.hpp (the built-in policies).

#include "gradapt/elastic/builtin_policies.hpp"
#include "gradapt/elastic/job.hpp"
