"""The ground floor every folder stands on, importing none of them: typed settings from JSON
(typed_json), the errors reported as one line (errors), durable writes (durable), the device and
process groups (comm), the K x D x P x T ranks (topology), the rank file that holds a state without
pickle (rank_file) and the balanced assignment of work to ranks (ownership)."""
