#pragma once
// Every diagnostic of qevict in one include. See docs/diagnostics.md for the definitions.

#include <qevict/diagnostics/trace.hpp>
#include <qevict/diagnostics/window_mass.hpp>
#include <qevict/diagnostics/window_sets.hpp>
#include <qevict/diagnostics/future_missed_mass.hpp>
#include <qevict/diagnostics/global_lir.hpp>
#include <qevict/diagnostics/selection_churn.hpp>
#include <qevict/diagnostics/mass_split.hpp>
#include <qevict/diagnostics/score_agreement.hpp>
