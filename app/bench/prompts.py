"""The load generator's texts: the common words of the ``random`` workload (W1, W2), the library help desk's
system prompt and questions (W3), and the passages to rewrite (W4). Fixed, so runs are comparable."""

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name"
).split()

SYSTEM_RULES = (
    "You are the help desk assistant of the city library. Answer questions from visitors politely, briefly and "
    "truthfully. Use only the facts below; when they do not answer a question, say that you do not know and "
    "suggest asking a librarian at the front desk. Never invent opening hours, prices or rules. Keep each answer "
    "under one hundred words and do not repeat the question."
)
SYSTEM_FACTS = [
    "The library opens at nine in the morning and closes at six in the evening from Monday to Saturday.",
    "On Sundays the library is closed, except for the reading room, which opens from noon to five.",
    "Visitors may borrow up to five books at a time for two weeks, and renew each book twice online.",
    "Late returns cost ten cents per book per day, up to a limit of five dollars per book.",
    "The reading room on the second floor is quiet at all times, and phone calls are not allowed there.",
    "Children under twelve must be accompanied by an adult in every part of the building except the children's floor.",
    "Printing costs ten cents per black and white page and fifty cents per color page.",
    "The library card is free for residents of the city and costs twenty dollars a year for everyone else.",
    "Lost cards can be replaced at the front desk for two dollars with a photo identity document.",
    "Group study rooms can be booked up to seven days in advance for at most three hours a day.",
    "Wireless internet is free; the network name is the library's name and no password is needed.",
    "Food is not allowed inside, but water in a closed bottle is welcome everywhere except the archive.",
]
QUESTIONS = [
    "When does the library open on {day}?", "How many books can I borrow about {topic}?",
    "What does it cost to print a page about {topic}?", "Can my child visit the {topic} shelves alone?",
    "How do I book a room to study {topic}?", "I lost my card while reading about {topic}. What now?",
    "Is there internet for my {topic} project?", "What happens if I return a {topic} book late?",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
PASSAGES = [
    "The museum opens at ten every morning and closes at five in the afternoon. Tickets cost twelve dollars for adults "
    "and six for children. Guided tours start every hour from the main hall. Photography without flash is allowed in "
    "all galleries except the special exhibition on the top floor.",
    "Our team meets every Monday at ten. Alice presents the weekly numbers, Bob reviews the open tickets, and Carol "
    "plans the next release. Meetings end at eleven. The notes are shared in the team folder by the end of the day, "
    "and anyone who missed the meeting reads them before Tuesday.",
    "To reset your password, open the settings page, choose security, and click reset password. A link is sent to "
    "your email address. The link expires after thirty minutes. If it expires, request a new one from the same page. "
    "Never share the link with anyone, including our support staff.",
    "The recipe needs two cups of flour, one cup of sugar, three eggs and a spoon of butter. Mix the flour and the "
    "sugar, add the eggs one at a time, then the melted butter. Pour the batter into a round pan and bake it for "
    "forty minutes at one hundred and eighty degrees, until the top is golden.",
]
REWRITE_INSTRUCTIONS = [
    "Rewrite the following passage in plain words, keeping every fact:\n\n{passage}",
    "Copy the following notice word for word, then stop:\n\n{passage}",
]
