// A stand-in GPU test program for tests/scripts/test_sanitize.sh: three doctest cases that behave
// as the environment says, so that bench/gpu/sanitize.sh's verdicts can be checked on a machine
// without a GPU.
//   STAND_IN_NO_DEVICE=1   exit 77 before doctest runs, as the GPU test programs do without a GPU
//   STAND_IN_FAIL=<text>   the cases whose name contains <text> fail
//   STAND_IN_SLEEP=<s>     every case sleeps s seconds
//   STAND_IN_LOG=<file>    every case appends its name to the file (which cases ran, how often)
//   STAND_IN_RUNNING=<dir> while a case runs, a file of its process stands in the folder; the case
//                          appends how many stood there at its start to <dir>.counts
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <unistd.h>

namespace {

void run_case(const std::string& name) {
  namespace fs = std::filesystem;
  if (const char* log = std::getenv("STAND_IN_LOG")) std::ofstream(log, std::ios::app) << name << '\n';
  const char* running = std::getenv("STAND_IN_RUNNING");
  fs::path mine;
  if (running != nullptr) {
    fs::create_directories(running);
    mine = fs::path(running) / std::to_string(::getpid());
    std::ofstream{mine};
    const auto n = std::distance(fs::directory_iterator(running), fs::directory_iterator{});
    std::ofstream(std::string(running) + ".counts", std::ios::app) << n << '\n';
  }
  if (const char* s = std::getenv("STAND_IN_SLEEP")) std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(s)));
  if (running != nullptr) fs::remove(mine);
  const char* fail = std::getenv("STAND_IN_FAIL");
  CHECK_MESSAGE((fail == nullptr || name.find(fail) == std::string::npos), "failed on purpose: " << name);
}

}  // namespace

TEST_CASE("a case whose name has commas, brackets [x] and 20%") { run_case("commas"); }
TEST_CASE("a plain case") { run_case("plain"); }
TEST_CASE("a case that runs out of device memory") { run_case("memory"); }

int main(int argc, char** argv) {
  if (std::getenv("STAND_IN_NO_DEVICE") != nullptr) {
    std::puts("no CUDA device: GPU tests skipped");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
