#pragma once
/// @file
/// GRADAPT_ARCHIVE_FIELDS: the `archive_fields()` tuple of a plain state struct whose archive
/// names are its member names, written with each member named once; GRADAPT_OPTION_FIELDS:
/// the same for the options of an optimizer stage, named "<stage> <member>".

#include <tuple>

#include "gradapt/core/archive.hpp"

/// `std::make_tuple(archive_member{"a", &S::a}, archive_member{"b", &S::b}, ...)` for the
/// members a, b, ... of S (at most 40): each field's archive name is its member name.
#define GRADAPT_ARCHIVE_FIELDS(S, ...) \
  std::make_tuple(__VA_OPT__(GRADAPT_DETAIL_AF_EXPAND(GRADAPT_DETAIL_AF_EACH(S, __VA_ARGS__))))

/// Rescans its argument enough times to unroll GRADAPT_DETAIL_AF_EACH over 40 members (one
/// member per rescan; the three levels below nest three rescans each).
#define GRADAPT_DETAIL_AF_EXPAND(...) \
  GRADAPT_DETAIL_AF_EXPAND_L3(GRADAPT_DETAIL_AF_EXPAND_L3(GRADAPT_DETAIL_AF_EXPAND_L3(__VA_ARGS__)))
/// Three nested GRADAPT_DETAIL_AF_EXPAND_L2 rescans.
#define GRADAPT_DETAIL_AF_EXPAND_L3(...) \
  GRADAPT_DETAIL_AF_EXPAND_L2(GRADAPT_DETAIL_AF_EXPAND_L2(GRADAPT_DETAIL_AF_EXPAND_L2(__VA_ARGS__)))
/// Three nested GRADAPT_DETAIL_AF_EXPAND_L1 rescans.
#define GRADAPT_DETAIL_AF_EXPAND_L2(...) \
  GRADAPT_DETAIL_AF_EXPAND_L1(GRADAPT_DETAIL_AF_EXPAND_L1(GRADAPT_DETAIL_AF_EXPAND_L1(__VA_ARGS__)))
/// One rescan.
#define GRADAPT_DETAIL_AF_EXPAND_L1(...) __VA_ARGS__
/// The archive_member of m, then the rest of the members through a deferred
/// GRADAPT_DETAIL_AF_AGAIN (expanded by the next rescan).
#define GRADAPT_DETAIL_AF_EACH(S, m, ...) \
  ::gradapt::archive_member{              \
      #m, &S::m} __VA_OPT__(, GRADAPT_DETAIL_AF_AGAIN GRADAPT_DETAIL_AF_PARENS(S, __VA_ARGS__))
/// The parentheses that call GRADAPT_DETAIL_AF_AGAIN one rescan later.
#define GRADAPT_DETAIL_AF_PARENS ()
/// Names GRADAPT_DETAIL_AF_EACH again, so that the recursion is not blocked.
#define GRADAPT_DETAIL_AF_AGAIN() GRADAPT_DETAIL_AF_EACH

/// `std::make_tuple(archive_member{"S a", &S::a}, archive_member{"S b", &S::b}, ...)`: the
/// options a, b, ... of stage S (at most 40), each named by the stage and the member.
#define GRADAPT_OPTION_FIELDS(S, ...) \
  std::make_tuple(__VA_OPT__(GRADAPT_DETAIL_AF_EXPAND(GRADAPT_DETAIL_OF_EACH(S, __VA_ARGS__))))
/// The archive_member of option m, then the rest through a deferred GRADAPT_DETAIL_OF_AGAIN.
#define GRADAPT_DETAIL_OF_EACH(S, m, ...) \
  ::gradapt::archive_member{              \
      #S " " #m, &S::m} __VA_OPT__(, GRADAPT_DETAIL_OF_AGAIN GRADAPT_DETAIL_AF_PARENS(S, __VA_ARGS__))
/// Names GRADAPT_DETAIL_OF_EACH again, so that the recursion is not blocked.
#define GRADAPT_DETAIL_OF_AGAIN() GRADAPT_DETAIL_OF_EACH
