// Every thread-position attribute MLX can inject into a kernel, filled per GPU thread by the
// runtime and handed to the generated entry point (shared layout of runtime.cpp and kernels).
#pragma once

struct ThreadIds {
  unsigned grid_size[3], threads_per_threadgroup[3], threadgroups_per_grid[3];
  unsigned thread_position_in_grid[3], thread_position_in_threadgroup[3], threadgroup_position_in_grid[3];
  unsigned thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  unsigned simdgroups_per_threadgroup, threads_per_simdgroup;
  unsigned quadgroup_index_in_threadgroup, thread_index_in_quadgroup, quadgroups_per_threadgroup;
};
