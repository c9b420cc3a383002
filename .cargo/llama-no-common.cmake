# Included at the end of each project() call of llama.cpp's CMake build
# (llama-cpp-sys-2 forwards every CMAKE_* variable; .cargo/config.toml sets
# CMAKE_PROJECT_INCLUDE to this file). llama-cpp-2 0.1.160 asks for
# llama-cpp-sys-2's default features, so llama.cpp's `common` library (arg
# parsing, chat parsers, downloads with cpp-httplib: 54 of its 128 compiled
# files) is built though nothing here uses it. Turning it off here, before
# llama.cpp's CMakeLists reads the option, keeps it out of every build.
if(PROJECT_NAME STREQUAL "llama.cpp")
  set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
endif()
