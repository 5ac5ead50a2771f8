# Sourced by the callgrind scripts (bench/batch-callgrind.sh, bench/preload/callgrind.sh).
# inclusive_per ANNOTATED DIVISOR REGEX: the largest inclusive instruction count among the
# lines of ANNOTATED (`callgrind_annotate --inclusive=yes` output) that match REGEX, divided
# by DIVISOR (messages or calls), as an integer.
inclusive_per() {
    awk -v c="$2" -v re="$3" '{v = $1; gsub(",", "", v); v += 0}
         $0 ~ re {if (v > m) m = v}
         END {printf "%d", m / c}' <<<"$1"
}
